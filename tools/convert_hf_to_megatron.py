"""Same as `megareason convert hf-to-megatron ...`; see `--help`."""

import sys

from megareason.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
