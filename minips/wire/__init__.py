"""The wire protocol, with no networking code at all: message fields and kinds, the frame codec
and its zero-copy receiver, the handshake and the conversation after it."""
