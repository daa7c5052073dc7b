"""Benchmarks shipped with the package: `graphrunner bench <name> ...` runs `<name>.main(argv)`."""
