"""Reproductions of the paper's findings that users can run (`./run.sh experiment NAME`)."""
