from timm_ls.main import main

raise SystemExit(main())
