from typing import Any
import argparse

def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    pass
