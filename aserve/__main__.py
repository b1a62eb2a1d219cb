from aserve.cli import main

raise SystemExit(main())
