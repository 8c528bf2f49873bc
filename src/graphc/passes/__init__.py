"""Graph passes over captured step programs; see README.md for the invariants every pass keeps."""
