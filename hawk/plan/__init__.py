"""Transfer plans: which source elements go to which destination page, and the requests that move them."""
