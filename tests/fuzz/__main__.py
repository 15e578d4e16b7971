"""python -m tests.fuzz --seconds N --seed S [--gpu] [--only cat,...]"""
import sys

from .run import main

sys.exit(main())
