"""Protocol buffers of Cleave's gRPC API; the generated modules are checked in (see
`router.proto.codegen`)."""
