"""The repository's tools (tools/README.md). A package so that the device kit (tools.device) is
imported by the tests and run as `python3 -m tools.device.NAME` from the repository root; the other
tools are scripts, each run by its path."""
