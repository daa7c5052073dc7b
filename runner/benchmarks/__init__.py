"""Benchmarks the CLI offers (`graphrunner bench <name>`): each module has `main(argv) -> int` and
writes its raw results to the folder given by `--out`."""
