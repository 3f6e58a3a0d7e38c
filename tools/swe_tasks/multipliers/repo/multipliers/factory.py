def make_multipliers(n: int):
    return [lambda x: x * i for i in range(n)]


def make_adder(k: int):
    return lambda x: x + k
