"""`python -m train` is `vit-train`."""

from train.cli import main

if __name__ == "__main__":
    main()
