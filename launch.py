"""meshllm entry point: `python launch.py --help`. The CLI lives in meshllm/launch.py."""

import sys

from meshllm.launch import main

if __name__ == "__main__":
    sys.exit(main())
