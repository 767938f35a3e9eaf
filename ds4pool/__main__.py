from ds4pool.cli import main

raise SystemExit(main())
