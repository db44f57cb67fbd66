"""A script that parses its arguments strictly, as most scripts do (argparse): it takes no --local_rank."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
args = parser.parse_args()
print("parsed steps", args.steps, flush=True)
