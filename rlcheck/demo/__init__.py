"""`rlcheck demo`: the real loop (`run`) and the synthetic stream (`synthetic`)."""
