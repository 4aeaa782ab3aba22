"""``python -m services.trainer --redis-url URL --drafter DIR --verifiers HOST:PORT``: run the SpecOPD trainer."""

from services.trainer.server import main

if __name__ == "__main__":
    main()
