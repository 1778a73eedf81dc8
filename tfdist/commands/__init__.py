"""One module per `tfdist` sub-command (see tfdist/cli.py)."""
