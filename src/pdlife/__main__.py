from pdlife.cli import main

raise SystemExit(main())
