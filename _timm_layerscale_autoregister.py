"""Registers the vit_ls variants with timm whenever timm is imported, with no import of timm_layerscale.

Installed beside the package and run at interpreter start by `timm_layerscale-autoregister.pth` (and by
`timm_layerscale-autoregister.start` on Pythons with PEP 829). Start-up only runs `install()`, which reads
one environment variable and puts a finder on `sys.meta_path`: nothing else is imported. When timm's own
import completes, the finder imports `timm_layerscale`, whose import registers the variants, before the
importer gets timm back. `TIMM_LAYERSCALE_AUTOREGISTER=0` switches this off.

This file imports only `os` and `sys`, which every interpreter has loaded before `site` runs.
"""

import os
import sys

SWITCH = "TIMM_LAYERSCALE_AUTOREGISTER"
SWITCH_OFF = ("0", "false", "off", "no")


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() not in SWITCH_OFF


def register() -> None:
    """Imports timm_layerscale, which registers the variants; a failure warns and leaves timm working."""
    try:
        import timm_layerscale  # noqa: F401
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken install's SystemExit must not end the user's `import timm` either
        message = (
            f"timm-layerscale could not register the vit_ls_* models with timm ({type(exc).__name__}: {exc}); "
            f"timm works without them. `import timm_layerscale` shows the whole error; "
            f"{SWITCH}=0 stops this attempt."
        )
        try:
            import warnings

            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # warnings turned into errors (-W error) must not break timm either
            sys.stderr.write(f"warning: {message}\n")


class _Loader:
    """Wraps timm's own loader: runs it, then `register()`. timm's module keeps its own loader."""

    def __init__(self, loader, finder: "TimmImportHook") -> None:
        self.loader = loader
        self.finder = finder

    def __getattr__(self, name: str):  # get_code, is_package, ... for callers of find_spec("timm")
        loader = self.__dict__.get("loader")
        if loader is None:  # a copy under construction: no recursion through self.loader
            raise AttributeError(name)
        return getattr(loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.remove()
        register()


class TimmImportHook:
    """A `sys.meta_path` finder that acts on `import timm` only: the other finders locate timm as usual."""

    searching = False  # set while asking the other finders, one of which may ask this one back

    def find_spec(self, name, path=None, target=None):
        if name != "timm" or self.searching:
            return None
        self.searching = True
        try:
            spec = next(filter(None, (f.find_spec(name, path, target) for f in self._others())), None)
        finally:
            self.searching = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def _others(self):
        return [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Start-up entry point: registers at once if timm is already imported, else when it is."""
    if not enabled() or any(isinstance(f, TimmImportHook) for f in sys.meta_path):
        return
    if "timm" in sys.modules:
        register()
    else:
        sys.meta_path.insert(0, TimmImportHook())
