from grids.grid import Grid
