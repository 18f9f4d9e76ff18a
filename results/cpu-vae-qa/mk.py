import sys
sys.path.insert(0, "/work/wt/qavae/tests/comfyui")
import make_models
make_models.main(sys.argv[1], sys.argv[2])
