from fxoffload.cli import main

raise SystemExit(main())
