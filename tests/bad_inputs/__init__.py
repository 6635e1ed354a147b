"""A corpus of bad inputs: every one must give one clear line naming the key, and change nothing."""
