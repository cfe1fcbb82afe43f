import sys

# `python -m kvslots`: the package itself is imported by then; kvslots.cli is light, and main()
# turns a Ctrl-C during the commands' heavier imports into one line and status 130.
try:
    from .cli import main
except KeyboardInterrupt:
    if sys.stderr is not None:  # None: started with stderr closed
        print("kvslots: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
