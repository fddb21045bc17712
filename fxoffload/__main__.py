from fxoffload.tools.cli import main

raise SystemExit(main())
