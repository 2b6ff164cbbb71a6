# Packaging tests: the installed tree is usable from CMake and pkg-config, and the shared
# library exports only the C ABI.
set(HSAP_CONSUMER_FLAGS "")
if(HSAP_SANITIZE)
  set(HSAP_CONSUMER_FLAGS "-fsanitize=address,undefined")
endif()
add_test(NAME packaging_install
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/packaging/install_test.sh ${PROJECT_BINARY_DIR}
                 ${CMAKE_CURRENT_SOURCE_DIR}/consumer ${CMAKE_COMMAND} ${CMAKE_C_COMPILER}
                 "${HSAP_CONSUMER_FLAGS}")
set_tests_properties(packaging_install PROPERTIES TIMEOUT 300)
add_test(NAME packaging_exports
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/packaging/exports_test.sh $<TARGET_FILE:hsap>
                 libhsap.so.${PROJECT_VERSION_MAJOR})
# libhsap.so is portable: built for the baseline ISA, beyond it only in the run-time
# dispatched kernel copies.
add_test(NAME packaging_portable
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/packaging/portable_test.sh
                 ${PROJECT_BINARY_DIR}/compile_commands.json $<TARGET_FILE:hsap> ${CMAKE_OBJDUMP})
set_tests_properties(packaging_portable PROPERTIES SKIP_RETURN_CODE 77)
# hsap_plan's command line: --help, checked output writes, the SVG's note on devices it
# leaves out.
if(TARGET hsap_plan)
  add_test(NAME bench_hsap_plan
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/bench/hsap_plan_test.sh
                   $<TARGET_FILE:hsap_plan> ${PROJECT_SOURCE_DIR}/clusters)
  set_tests_properties(bench_hsap_plan PROPERTIES TIMEOUT 300)
endif()
# bench/device_check.sh cannot run here (no GPU): it parses, and its dry run lists the
# tensor-core comparison runs.
add_test(NAME bench_device_check
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/bench/device_check_test.sh
                 ${PROJECT_SOURCE_DIR}/bench/device_check.sh)
# hsap_attn_perf's cuda-loopback backend (and so its cuDNN comparison) without a CUDA driver:
# a clear message and exit 1 before any row.
if(TARGET hsap_attn_perf)
  add_test(NAME bench_attn_perf_no_gpu
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/bench/attn_perf_no_gpu_test.sh
                   $<TARGET_FILE:hsap_attn_perf>)
endif()
# README.md and docs/: the README stays a product page (at most 300 lines), every link and
# anchor resolves, every quoted command names files and flags that exist.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME docs_check COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/scripts/check_docs.py)
  # The cost model's validation table (docs/cost_model.md, section 6) is what the model
  # predicts now, and every ratio to the measurement is within 0.8-1.25.
  if(TARGET hsap_plan)
    add_test(NAME docs_cost_model_validation
             COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/scripts/validate_cost_model.py
                     --plan $<TARGET_FILE:hsap_plan> --check ${PROJECT_SOURCE_DIR}/docs/cost_model.md)
  endif()
endif()
# Labels by cost (tests/CMakeLists.txt): these scripts run the installed tree, the benches and
# the docs against the tree, each in seconds to a minute.
foreach(t packaging_install packaging_exports packaging_portable bench_hsap_plan bench_device_check
          bench_attn_perf_no_gpu docs_check docs_cost_model_validation)
  if(TEST ${t})
    set_tests_properties(${t} PROPERTIES LABELS integration)
  endif()
endforeach()
