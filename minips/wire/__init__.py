"""The wire: message kinds, frames, the sans-IO codec and handshake; no IO."""
