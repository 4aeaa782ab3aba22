"""`python -m services.verifier`: start the target verifier service."""

from services.verifier.server import main

if __name__ == "__main__":
    main()
