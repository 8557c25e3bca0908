"""The engine's own TCP protocol: the authenticated handshake and frames (wire), and the listener
that serves a segment's memory, descriptor and control calls to peers."""
