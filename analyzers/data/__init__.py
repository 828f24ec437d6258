"""The data family: the input pipeline (DataLoader)."""
