"""The --fix processes: scratch copies, confined arms, measuring and the loop that compares them."""
