"""`python -m train` is `vit-train` (through its launcher: without torch, one line that says what to install)."""

import sys

from train.launch import main

if __name__ == "__main__":
    sys.exit(main())
