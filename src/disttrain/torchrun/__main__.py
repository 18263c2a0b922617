"""`python -m disttrain.torchrun`: one DDP rank under torchrun (or `disttrain ddp`); typed
by hand without torchrun, the same as `disttrain ddp`."""

import os
import sys

from disttrain.cli.ddp import module_main

if __name__ == "__main__":
    sys.exit(module_main(sys.argv[1:], os.environ))
