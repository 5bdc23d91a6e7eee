"""`python -m paxkv`: the command line (paxkv.entrypoints.run)."""

from paxkv.entrypoints.run import run

if __name__ == "__main__":
    run()
