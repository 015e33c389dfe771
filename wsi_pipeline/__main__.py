import sys

from wsi_pipeline.cli.main import main

sys.exit(main())
