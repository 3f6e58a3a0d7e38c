from stats.basic import mean, total
