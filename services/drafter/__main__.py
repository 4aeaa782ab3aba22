"""``python -m services.drafter --model DIR --port N``: serve one D3D drafter replica."""

from services.drafter.server import main

if __name__ == "__main__":
    main()
