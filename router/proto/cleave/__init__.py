"""Generated code for package cleave.v1; do not edit by hand."""
