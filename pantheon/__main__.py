from pantheon.cli import main

raise SystemExit(main())
