"""The parameter server's store: tables of rows with their optimizer slots, id maps, bounds and the disk tier, in this process."""
