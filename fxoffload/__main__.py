from fxoffload.tools.cli import main

if __name__ == "__main__":  # not when a spawned worker imports the parent's main module (fxoffload fit --jobs)
    raise SystemExit(main())
