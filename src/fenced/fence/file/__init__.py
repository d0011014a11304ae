"""``file:`` stores: a directory, a state log and immutable objects."""
