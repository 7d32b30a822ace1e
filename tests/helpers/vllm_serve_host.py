"""The host that `vllm serve`'s own argument parser (vllm/entrypoints/cli/main.py) ends with, for each argument list.

<serve env>/bin/python tests/helpers/vllm_serve_host.py '[["serve", "MODEL", ...], ...]'    prints a JSON list
"""

import json
import sys

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = []
for argv in json.loads(sys.argv[1]):
    parser = FlexibleArgumentParser(description="vLLM CLI")
    ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    out.append(parser.parse_args(argv).host)
print(json.dumps(out))
