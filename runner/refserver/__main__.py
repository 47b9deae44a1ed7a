from runner.refserver.cli import main

raise SystemExit(main())
