"""Helpers shared by the benchmark scripts that summarise several seeds."""
import statistics


def cell(values, fmt):
    """median [min-max] of values, each written with fmt (e.g. '{:.1f}')."""
    values = sorted(values)
    return f"{fmt.format(statistics.median(values))} [{fmt.format(values[0])}-{fmt.format(values[-1])}]"
