"""Same as `megareason convert megatron-to-hf ...`; see `--help`."""

import sys

from megareason.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
