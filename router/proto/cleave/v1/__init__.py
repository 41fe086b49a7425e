"""Generated code for package cleave.v1 (generate.proto); do not edit by hand."""
