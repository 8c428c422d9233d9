"""Generated protobuf code: do not edit; run `make protos`."""
