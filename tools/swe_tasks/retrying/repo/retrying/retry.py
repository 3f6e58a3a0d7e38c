def retry(fn, attempts: int = 1, exceptions=(Exception,)):
    """Call fn() up to `attempts` times (3 by default); re-raise the last error."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    for i in range(attempts):
        try:
            return fn()
        except exceptions:
            if i == attempts - 1:
                raise
