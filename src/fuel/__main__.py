from fuel.cli import main

raise SystemExit(main())
