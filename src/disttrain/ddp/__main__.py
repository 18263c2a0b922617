"""`python -m disttrain.ddp`: one rank under torchrun (or `disttrain ddp`), else the launcher."""

import os
import sys

from disttrain.ddp.command import module_main

if __name__ == "__main__":
    sys.exit(module_main(sys.argv[1:], os.environ))
