"""`python -m disttrain` is the same as the `disttrain` command."""

from disttrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
