"""Benchmarks installed with the package: `graphrunner bench <name>` runs `runner.benchmarks.<name>.main(argv)`."""
